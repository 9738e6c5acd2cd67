"""`graphrunner serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over graphrunner.async_llm.AsyncLLM.

`build_app(llm, served_model_name, api_key)` returns the app; `graphrunner.cli` runs it with uvicorn.
"""

from graphrunner.server.app import build_app

__all__ = ["build_app"]
