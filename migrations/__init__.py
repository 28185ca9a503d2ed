"""crest's Alembic migrations, shipped inside the wheel as `crest.migrations` (read with importlib.resources)."""
