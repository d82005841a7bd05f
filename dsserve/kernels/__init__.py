"""Triton kernels for the GPU path, each beside the torch reference it is tested against.

Every module exposes ``<op>_ref`` (plain torch, the truth on any device) and ``<op>`` (Triton). On a machine
without a GPU the Triton versions still run under ``TRITON_INTERPRET=1`` (tests use tiny shapes there).
"""
