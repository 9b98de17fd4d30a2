"""LatentMoE: expert load, imbalance, weight by rank, co-activation, latent routing, router biases."""

from app.render import page_scaffold

page_scaffold.render_section_page(
    "moe",
    "Routed experts working in a narrower latent width: how evenly tokens spread over experts (MaxVio, CV, "
    "entropy, dead experts), the weight of each routing rank, which experts fire together, the latent "
    "vectors coloured by expert, and the selection biases.",
)
