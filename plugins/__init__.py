"""Built-in policies and allocators; they register through the `kestrel` entry-point group like any plugin."""
