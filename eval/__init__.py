"""Accuracy and serving evaluation of sparseserve_hf (scripts; the package never imports this)."""
