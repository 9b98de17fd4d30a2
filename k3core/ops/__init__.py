from .kda import kda_chunk, kda_recurrent, kda_step  # noqa: F401
