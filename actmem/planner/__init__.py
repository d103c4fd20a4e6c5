"""Choosing the run: the sweep, its time model, FLOPs, --explain and the nearest GPU counts that fit."""
