"""Triton kernels for streamer, each next to the plain-torch reference that defines it.

This module is imported as a side effect by transformers (it probes for a package named
`kernels`), so it must stay cheap: no triton, no transformers, nothing heavy at import time.
Import the submodules explicitly.
"""
