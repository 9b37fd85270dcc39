"""The host side of sandboxes: booting guests, spawning VMM processes, supervision."""
