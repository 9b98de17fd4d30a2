"""Drawing and caching: the page scaffold, figure cards, errors."""
