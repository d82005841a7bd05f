"""Triton kernels for the GPU path, each beside the torch reference it is tested against.

Every module exposes ``<op>_ref`` (plain torch, the truth on any device) and ``<op>`` (Triton). On a machine
without a GPU the Triton versions still run under ``TRITON_INTERPRET=1`` (tests use tiny shapes there).

Triton compiles a kernel anew for every new combination of its constexprs and of its int arguments' alignment (a
multiple of 16, or 1), and the step that meets one waits for it (0.5-5 s on the H200). So what changes from step to
step (row counts, context lengths, table widths) is passed as a runtime int, never a constexpr (tiles are rounded to
a power of two), and a row count that only bounds masks is listed in ``do_not_specialize``: a live replay-off server
compiled 91 kernels in two minutes of traffic before this (engine.jit_compiles counts them on a GPU;
kernels.launch_census lists the keys a run needs on the CPU, and tests/engine/test_compile_keys.py holds the rule).
"""
