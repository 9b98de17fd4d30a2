"""The runs the app offers: the run list, the library, opened folders."""
