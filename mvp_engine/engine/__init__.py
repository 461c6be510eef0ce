"""Generic, model-free training engine shared by every recipe."""

import logging

# bitsandbytes (model.quantization, the qlora extra; the dev extra installs it) logs at import, on CPUs with
# AVX512-BF16, that an optional hub kernel is missing and it takes its torch fallback. peft imports it whenever it is
# installed, so every run and every test worker started with a "Failed to load ..." line about a kernel no run here
# uses (a hub download is not an option). Its errors still show.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
