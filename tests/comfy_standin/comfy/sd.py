"""Stand-in for ``comfy.sd``: checkpoints hold no CLIP or VAE here."""


def load_state_dict_guess_config(sd, output_vae=True, output_clip=True, output_clipvision=False,
                                 embedding_directory=None, output_model=True, model_options={}, te_model_options={},
                                 metadata=None):
    return None, None, None, None
