"""Stand-in for ComfyUI's ``folder_paths``; tests point ``models_dir`` at a temp dir."""
import os

models_dir = os.path.join(os.getcwd(), "models")
folder_names_and_paths = {}


def get_folder_paths(folder_name):
    return folder_names_and_paths[folder_name][0][:]


def get_filename_list(folder_name):
    """Names relative to each search path, subfolders included (as ComfyUI lists them)."""
    paths, exts = folder_names_and_paths[folder_name]
    out = set()
    for p in paths:
        for d, _, files in os.walk(p, followlinks=True):
            out |= {os.path.relpath(os.path.join(d, f), p) for f in files
                    if not exts or os.path.splitext(f)[1] in exts}
    return sorted(out)


def get_full_path(folder_name, filename):
    for p in folder_names_and_paths[folder_name][0]:
        full = os.path.join(p, filename)
        if os.path.isfile(full):
            return full
    return None


def get_full_path_or_raise(folder_name, filename):
    full = get_full_path(folder_name, filename)
    if full is None:
        raise FileNotFoundError(f"Model in folder '{folder_name}' with filename '{filename}' not found.")
    return full


def add_model_folder_path(folder_name, full_folder_path, is_default=False):
    paths, exts = folder_names_and_paths.setdefault(folder_name, ([], set()))
    if full_folder_path in paths:
        paths.remove(full_folder_path)
    paths.insert(0, full_folder_path) if is_default else paths.append(full_folder_path)
