"""Adapters that let real training frameworks run their stream logic under the detector."""
