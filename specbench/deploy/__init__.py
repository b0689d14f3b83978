"""The client-server deployment (MoA paper section 4.2, appendix A.2; issue 78; docs/deploy.md): `link` (a seeded
user-space emulation of a 5G/4G link on the TCP send path), `protocol` (the versioned binary messages: hello, the
client's tree, the server's answer with 8-bit activations), `tcp` (framing over a real socket, the handshake, one-line
errors for a port in use and a peer gone), `split` (deploy=client_server's config, which drafters run split),
`server` (the target and a LocalVerifier behind a port) and `client` (the drafter's side: a RemoteVerifier the engine
drives). A layer between data/ and train/: it imports decode/ and core/.
"""
