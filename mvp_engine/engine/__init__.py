"""Generic, model-free training engine shared by every recipe."""
