"""The diffusion engine (image / video generation stage): see ARCHITECTURE.md, `diffusion/`.

Entry point: `omnistage.diffusion.engine.DiffusionEngine` (a StageEngine). Import it from its module;
this package stays import-light so `diffusion.scheduler` can be used without torch.
"""
