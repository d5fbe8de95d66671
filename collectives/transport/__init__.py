"""The executors that run compiled plans, and the progress engine that drives them.

``scheduler`` holds the one scheduling rule they share; ``progress`` the engine every
call in flight of a communicator is driven by (and :class:`~.progress.Handle`);
``mpi`` runs plans over MPI point-to-point messages on the engine; ``lean`` runs a
blocking call's plan straight through (and persistent programs); ``shm`` runs the
shared-memory algorithms' plans on the node's window; ``device`` and ``device_call``
run plans on device buffers; ``p2p`` carries sends and receives; ``local`` runs every
rank's plan inside one process (tests, the simulator); ``liveness`` answers who is
alive when a wait times out."""
