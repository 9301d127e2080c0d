"""Parallel execution: rank launch and process groups (group.py), tensor-parallel layers and plans (tensor.py).

Sits below the engines and models (`ar | diffusion | codec`, `models` import it) and above `layers | io`.
"""
