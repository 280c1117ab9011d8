"""A launch's console: what eight ranks print, said once.

Every rank of a launch imports the same libraries and meets the same warnings, so the console
repeats each of them eight times (DeepSpeed's accelerator probe, PyTorch's and transformers'
warnings), with a source line under each. Rank 0 prints each distinct warning once, on one line;
the other ranks print errors only (so a warning only another stage meets goes unseen: a
PYTHONWARNINGS the user sets turns all of this off). Set before the libraries are imported: some
warn at import.
"""
import logging
import os
import warnings


def quiet(rank: int) -> None:
    """As above; a PYTHONWARNINGS the user set is left to act instead (on every rank: a warning
    only another stage meets is otherwise not shown)."""
    if os.environ.get("PYTHONWARNINGS"):
        return
    if rank != 0:
        warnings.simplefilter("ignore")
        logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        return
    warnings.simplefilter("once")        # once per distinct message, wherever it is raised
    for hidden in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", hidden)   # what Python hides by default stays hidden
    warnings.formatwarning = one_line


def one_line(message, category, filename, lineno, line=None) -> str:
    """`UserWarning: text (file.py:12)`: no second line quoting the source."""
    text = " ".join(str(message).split())
    return f"{category.__name__}: {text} ({os.path.basename(filename)}:{lineno})\n"
