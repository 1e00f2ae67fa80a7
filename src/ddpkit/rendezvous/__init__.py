"""The elastic rendezvous and the stores behind it: the `--rdzv-backend=ddpkit`
handler (handler), its timeouts, polls and expiries (timing), the run key and
the store namespaces derived from it (runkey), and a store's listening socket
(listening). The store service is the command `python -m ddpkit.rdzv_store`."""
