"""Users' own code (contract §6): upload a folder as a `.tar.gz`, run jobs in a copy of it."""
