"""Every test session measures into its own cache folder (and so do the processes tests launch, which inherit the
environment): a user's ``~/.cache/vlm_packing`` is never read or written by the tests."""

import os
import tempfile

os.environ["VLM_PACKING_CACHE"] = tempfile.mkdtemp(prefix="vlm_packing_cache_")
