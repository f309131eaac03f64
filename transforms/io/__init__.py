"""Lake IO: fsspec reads and atomic writes with retries (storage.py), the lake layout's readers and writers
(lake.py), small YAML mappings (meta_yaml.py). No Beam."""
