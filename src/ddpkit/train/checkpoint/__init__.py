"""Checkpoints: what a save gathers and writes, the files (atomic, rotated, a latest pointer), and the
last completed step written when a peer is lost.
"""
