"""The OpenAI-compatible server's public names, gathered from the modules that own them.

- app.py: ``build_app`` (routes, middleware), ``add_cors``, ``GateMiddleware``;
- serve_config.py: parsed flags -> ``settings_from_args``, ``engine_config_from_args``,
  ``tokenizer_from_args``;
- lifecycle.py: ``run_server`` (startup, drain on SIGTERM, shutdown).
"""
from __future__ import annotations

from .app import GateMiddleware, add_cors, build_app
from .lifecycle import run_server
from ..cli.serve_config import engine_config_from_args, settings_from_args, tokenizer_from_args

__all__ = ["GateMiddleware", "add_cors", "build_app", "engine_config_from_args", "run_server",
           "settings_from_args", "tokenizer_from_args"]
