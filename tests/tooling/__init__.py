"""The project's tooling: the linters configured in pyproject.toml, and build_llama.sh on a small
stand-in for llama.cpp. Not unit tests of the sidecar: they run programs."""
