"""VRAM: live report (``live``), no-GPU estimate on fake tensors (``estimate``), GPU study (``study``).

Importing this package is cheap and never imports torch: ``estimate`` runs its work in a subprocess
(``estimate_worker``) that loads the fake-CUDA shim before torch.
"""
