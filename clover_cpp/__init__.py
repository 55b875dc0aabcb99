"""Clover on llama.cpp: Python side."""
