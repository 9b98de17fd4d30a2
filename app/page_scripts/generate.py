"""Generate: prompt -> text with the cached decoder (KDA: fixed-size state, MLA: per-token latent)."""

from __future__ import annotations

import time

import streamlit as st
import torch

from app.render import page_scaffold
from app.render.errors import md_escape, plain
from app.render.model_use import model_use
from app.state.inputs import MAX_TEXT_CHARS
from k3core.modeling.cache import K3Cache
from k3core.utils.input_limits import MAX_PROMPT_TOKENS

inputs = page_scaffold.inputs_or_stop()
run = inputs.run
page_scaffold.page_header(
    "generate",
    "Sample text from the chosen run. The prompt is read in one forward pass; then each new token "
    "reads and extends the decode cache: KDA layers keep a fixed-size state, MLA layers one latent per token.",
)

loaded_run = page_scaffold.run_or_stop(inputs, needs_weights=True)
model = loaded_run.model
tok = loaded_run.tokenizer
if tok is None:
    why = [note for note in loaded_run.card["notes"] if "tokenizer" in note]
    st.error(
        f"**{md_escape(run.label)}** cannot be prompted with text: {plain(why[0]) if why else 'it has no tokenizer'}"
    )
    st.stop()
st.caption(f"Tokenizer: {tok.name}")  # file name and counts: no user text


def show_result(result: dict, live: bool = False) -> None:
    """The output: heading, text, new tokens, speed, decode cache and a download; a note when the generation was
    stopped before its end (or, while it runs, how far it is: a Stop keeps all of this on the page)."""
    st.markdown(f"#### Output of {md_escape(result['run'])}")
    if not result.get("done", True):
        note = "generating" if live else "stopped"
        st.caption(f"{note}: {result['new']:,} of {result.get('asked', result['new']):,} new tokens")
    st.code(result["prompt"] + result["text"], language=None)
    c = st.columns(3)
    c[0].metric("New tokens", f"{result['new']:,}")
    c[1].metric("Speed", f"{result['new'] / max(result['seconds'], 1e-9):,.0f} tokens/s")
    c[2].metric(
        "Decode cache",
        f"{result['cache_bytes'] / 1024:,.1f} KiB",
        f"after {result['cache_tokens']:,} tokens",
        delta_color="off",
    )
    st.download_button(
        "Download text",
        data=result["prompt"] + result["text"],
        file_name="k3lab-generated.txt",
        mime="text/plain",
        # while generating the button is drawn again every 16 tokens, in one script run: each redraw needs its own
        # id (the auto id hashes label and file name only, so the third redraw collided), keyed by the count so far
        key=f"k3lab_gen_download_live_{result['new']}" if live else "k3lab_gen_download",
    )


with st.form("k3lab_generate"):
    prompt = st.text_area("Prompt", value="ROMEO:\n", height=100, key="k3lab_prompt")
    c = st.columns(4)
    new_tokens = c[0].slider("New tokens", 1, 1024, 200, key="k3lab_gen_tokens")
    temperature = c[1].slider("Temperature (0 = greedy)", 0.0, 2.0, 0.8, 0.05, key="k3lab_gen_temp")
    top_k = c[2].number_input("Top-k (0 = off)", 0, int(model.config.vocab_size), 0, key="k3lab_gen_topk")
    seed = c[3].number_input("Seed", 0, 2**31 - 1, 0, key="k3lab_gen_seed")
    go = st.form_submit_button("Generate text", type="primary")

if go:
    if not prompt:
        st.error("The prompt is empty: type at least one character.")
        st.stop()
    if len(prompt) > MAX_TEXT_CHARS:  # refused, not tokenised nor written back into the page
        st.error(f"The prompt is {len(prompt):,} characters, over the limit of {MAX_TEXT_CHARS:,}: shorten it.")
        st.stop()
    ids = tok.encode(prompt)[-MAX_PROMPT_TOKENS:]  # the CLI refuses a longer prompt; the page reads its end
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    cache = K3Cache.for_config(model.config)
    live = st.empty()
    produced: list[int] = []
    start = time.perf_counter()

    def _result(done: bool) -> dict:
        return {
            "run": run.label,
            "prompt": prompt,
            "text": tok.decode(produced),
            "new": len(produced),
            "asked": int(new_tokens),
            "seconds": time.perf_counter() - start,
            "cache_bytes": cache.nbytes(),
            "cache_tokens": cache.seen_tokens,
            "done": done,
        }

    def _stream(column: torch.Tensor) -> None:
        produced.append(int(column[0]))
        if len(produced) % 16 == 0:
            # Kept as it goes: a Stop ends the script here, and what is on the page (heading, text, speed, cache,
            # download) and in the session (shown as "stopped" on the next run) is the text so far.
            partial = _result(done=False)
            st.session_state["k3lab_generated"] = partial
            with live.container():
                show_result(partial, live=True)

    try:
        with model_use(model):  # shared: other sessions' forwards run at the same time
            out = model.generate(
                x,
                max_new_tokens=int(new_tokens),
                temperature=max(float(temperature), 1e-6),
                do_sample=temperature > 0,
                top_k=int(top_k) or None,
                generator=gen,
                stream=_stream,
                cache=cache,
            )
    except (ValueError, RuntimeError) as exc:
        live.empty()
        st.session_state.pop("k3lab_generated", None)
        st.error(f"Generation failed: {exc}")
        st.stop()
    produced = out[0, len(ids) :].tolist()
    live.empty()
    st.session_state["k3lab_generated"] = _result(done=True)

result = st.session_state.get("k3lab_generated")
if result:
    show_result(result)
