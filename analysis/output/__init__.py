"""What leaves the process: the report, files of figures, numbers as text."""
