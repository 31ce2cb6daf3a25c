"""Shared library of both stages: config, model, data, engine, checkpoint, evaluation, tracking."""
