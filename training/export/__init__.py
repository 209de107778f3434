"""Exporters from torch models to paraseek model bundles, and their quantisation.

``openclip``: open_clip models (both towers); ``hf_text``: Hugging Face sentence encoders, optionally
with trained alignment layers; ``starter``: the offline starter dual encoder. Each writes a bundle
(``paraseek.core.bundle``) that ``paraseek.core.encoder.Encoder`` loads.
"""
