"""Model families of the diffusion engine: one file per diffusers pipeline family (stage process).

Each family is declared in the model registry (`models/registry.py`) under the model_index.json
`_class_name` it serves; `pipeline/build.py` hands the family class to the `DiffusionEngine`.
"""
