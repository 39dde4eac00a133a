def add_local_args(p):
    pass
