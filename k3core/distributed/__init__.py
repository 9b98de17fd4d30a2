"""Several GPUs: the rank plan and the pipeline-parallel trace."""
