"""crest's inspection queries, shipped inside the wheel as `crest.sql` (read with importlib.resources)."""
