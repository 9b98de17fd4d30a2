"""The diagnostics: trace or config in, tidy tables out."""
