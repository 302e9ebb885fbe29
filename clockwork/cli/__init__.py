"""The `clockwork` command line: one module per command group (``*_cmd``), and the offline models and views only it
uses (``goodput``, ``peer_copy_model``, ``job_story``, ``lens_render``). It reaches node daemons through
``clockwork.contracts``' client, never by importing ``clockworkd``."""
