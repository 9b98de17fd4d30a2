"""AttnRes: depth-softmax weights per site, pseudo-query norms, scale/bias residuals, hidden-state growth."""

from app.render import page_scaffold

page_scaffold.render_section_page(
    "attnres",
    "Attention over depth instead of a plain residual: which earlier blocks each sub-layer reads from, how "
    "peaked those depth weights are, the learned scale/bias of the scale-bias residual, and how the hidden "
    "state's RMS grows with depth.",
)
