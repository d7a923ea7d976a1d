"""Watching a live run: the alerts `pilotrun watch` raises against a recipe lock."""
