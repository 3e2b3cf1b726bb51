"""Stand-in for ComfyUI's ``folder_paths``; tests point ``models_dir`` at a temp dir."""
import os

models_dir = os.path.join(os.getcwd(), "models")
folder_names_and_paths = {}


def get_folder_paths(folder_name):
    return folder_names_and_paths[folder_name][0][:]


def get_filename_list(folder_name):
    paths, exts = folder_names_and_paths[folder_name]
    out = set()
    for p in paths:
        if os.path.isdir(p):
            out |= {f for f in os.listdir(p) if not exts or os.path.splitext(f)[1] in exts}
    return sorted(out)


def get_full_path(folder_name, filename):
    for p in folder_names_and_paths[folder_name][0]:
        full = os.path.join(p, filename)
        if os.path.isfile(full):
            return full
    return None
