"""Helpers that tests share: task and candidate cases, scripted policies and evaluators."""
