"""Stand-in for ``modules.sd_models``: loading weights into the live model, and moving it off the GPU and back, as
upstream does."""
from modules import devices, lowvram, script_callbacks, shared

standin_calls = []


def load_model_weights(model, checkpoint_info, state_dict, timer):
    """Load ``state_dict`` into the same model object (``load_state_dict(strict=False)``), as a checkpoint switch
    between models of one architecture does."""
    if hasattr(model, "before_load_weights"):
        model.before_load_weights(state_dict)
    model.load_state_dict(state_dict, strict=False)
    model.sd_checkpoint_info = checkpoint_info
    model.sd_model_hash = checkpoint_info.shorthash
    model.sd_model_checkpoint = checkpoint_info.filename


def reload_model_weights(sd_model=None, info=None, forced_reload=False):
    """Switch the current model to checkpoint ``info`` (carrying ``.standin_state_dict``) in place."""
    sd_model = sd_model or shared.sd_model
    if info is None or (sd_model.sd_model_checkpoint == info.filename and not forced_reload):
        return sd_model
    try:
        load_model_weights(sd_model, info, info.standin_state_dict, None)
    finally:
        script_callbacks.model_loaded_callback(sd_model)
    return sd_model


def send_model_to_cpu(m):
    """Off the GPU: its --medvram/--lowvram part, else the whole model; then the cache emptied."""
    standin_calls.append(("send_model_to_cpu", m))
    if m.lowvram:
        lowvram.send_everything_to_cpu()
    else:
        m.to(devices.cpu)
    devices.torch_gc()


def send_model_to_device(m):
    """Back: with --medvram/--lowvram its parts move when used, else the whole model to the device."""
    standin_calls.append(("send_model_to_device", m))
    if not m.lowvram:
        m.to(shared.device)
