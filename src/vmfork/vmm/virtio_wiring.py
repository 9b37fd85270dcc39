def add_configured_devices(machine, config):
    pass
