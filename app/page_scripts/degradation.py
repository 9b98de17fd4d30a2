"""Attention degradation diagnostics: entropy collapse, sinks, rank collapse, redundancy, massive activations."""

from app.render import page_scaffold

page_scaffold.render_section_page(
    "degradation",
    "Warning signs of a degrading stack: attention entropy collapse and sinks (MLA layers), rank collapse and "
    "token uniformity of the hidden states, layer redundancy (Block Influence, CKA), massive activations, and "
    "for KDA layers their state-based counterparts.",
)
