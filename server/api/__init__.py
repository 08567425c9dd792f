"""HTTP API: TGI and OpenAI wire formats on one FastAPI app (see server/api/app.py)."""
