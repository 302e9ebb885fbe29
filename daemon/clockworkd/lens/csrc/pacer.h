/* clockworkd.lens._probeio.Pacer: the thread that sends every NIC's probes on the probe interval. */
#ifndef CLOCKWORK_PACER_H
#define CLOCKWORK_PACER_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Add the Pacer type to the module; -1 with an exception set on failure. */
int pacer_add_type(PyObject *module);

#endif
