/* The valid-call test of arnorm.AllReduceNorm.__call__ in C (arnorm/op/_accel.py builds and loads it).
 *
 * accept(state, dispatch, hidden_states, residual, weight, scale, out) runs the rule of the fast test in
 * arnorm/op/_call.py for contiguous rows with a residual, and on success calls the backend's fast
 * path fast(t, hidden_states, residual, weight, scale, out, hp, rp, wp, sp) and returns its result.
 * Anything else (a test that fails, an input it cannot read, a weight, scale or out not trusted yet,
 * grad mode with an input requiring grad, strided rows, no fast path) returns NotImplemented, and
 * the Python call runs as if this did not exist: it checks again, raises the error, or trusts the
 * new weight. None: the fast path declined the call (the Python call then skips it). With out=, a
 * result that does not hand back out's tensors (by identity) comes back wrapped in a 1-tuple, for
 * the Python call to check in full and raise naming the backend. So this
 * accepts a subset of what the Python test accepts and never raises for bad input; tests hold the
 * two equal on every input they draw. Why C: the Python test is about 25
 * calls into torch, and the interpreter's own work between them cost as much as the calls.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef unsigned long long u64;

/* The fields of arnorm.op._accel.AccelState (a tuple), in its order: tests/op/test_accel.py holds them equal. */
enum {
    ST_HIDDEN, ST_ROW_BYTES, ST_DTYPE, ST_ON_CPU, ST_DEVICE_INDEX, ST_MAX_TOKENS, ST_SCALED, ST_ADD_RESIDUAL,
    ST_TOKEN, ST_FAST_TABLE, ST_WEIGHTS, ST_SCALES, ST_OUT_SPANS, ST_GRAD_ENABLED, ST_LEN
};

static PyObject *s_shape, *s_data_ptr, *s_is_contiguous, *s_get_device, *s_dtype, *s_requires_grad,
    *s_is_cpu, *s_last_weight, *s_last_wptr, *s_is_neg;

/* 1 true, 0 false, -1 error (raised). */
static int is_true_method(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) return -1;
    int v = (r == Py_True);
    Py_DECREF(r);
    return v;
}

/* obj.name is expected (identity: True, a dtype); 1, 0, or -1 with an error raised. */
static int attr_is(PyObject *obj, PyObject *name, PyObject *expected) {
    PyObject *r = PyObject_GetAttr(obj, name);
    if (r == NULL) return -1;
    int v = (r == expected);
    Py_DECREF(r);
    return v;
}

/* The int a Python int holds as u64; 0 and an error for anything else (negative, not an int). */
static int as_u64(PyObject *v, u64 *out) {
    if (!PyLong_CheckExact(v)) return -1;
    *out = PyLong_AsUnsignedLongLong(v);
    if (*out == (u64)-1 && PyErr_Occurred()) return -1;
    return 0;
}

/* obj.data_ptr() as a new reference (kept: it is handed on to the fast path) and its value. */
static PyObject *data_ptr(PyObject *obj, u64 *p) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, s_data_ptr);
    if (r == NULL) return NULL;
    if (as_u64(r, p) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    return r;
}

/* table.get(id(obj)) == ptr for a table of id -> data pointer; 0 when absent or different. */
static int trusted(PyObject *table, PyObject *obj, u64 ptr) {
    PyObject *key = PyLong_FromVoidPtr(obj);
    if (key == NULL) return -1;
    PyObject *v = PyDict_GetItemWithError(table, key); /* borrowed */
    Py_DECREF(key);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    u64 p;
    if (as_u64(v, &p) < 0) return -1;
    return p == ptr;
}

/* The device test of the Python rule: is_cpu on a CPU op, get_device() == index on a GPU op. */
static int on_device(PyObject *t, int on_cpu, long index) {
    if (on_cpu) return attr_is(t, s_is_cpu, Py_True);
    PyObject *r = PyObject_CallMethodNoArgs(t, s_get_device);
    if (r == NULL) return -1;
    long d = PyLong_AsLong(r);
    Py_DECREF(r);
    if (d == -1 && PyErr_Occurred()) return -1;
    return d == index;
}

/* A torch.Size of exactly two ints: 1 and its sizes, 0 for any other shape, -1 error. */
static int shape2(PyObject *shape, long long *rows, long long *cols) {
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != 2) return 0;
    PyObject *a = PyTuple_GET_ITEM(shape, 0), *b = PyTuple_GET_ITEM(shape, 1);
    if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b)) return 0;
    *rows = PyLong_AsLongLong(a);
    *cols = PyLong_AsLongLong(b);
    if (PyErr_Occurred()) return -1;
    return 1;
}

/* The fast path's result r holds the caller's out o (Output namedtuples: normed, residual, quant):
 * the same normed, the same residual where out has one (an in-place op ignores it), the same quant
 * data and scale, or the call's scale for fp8_static (no global_scale field set). 1, or 0 for the
 * Python call's full check. */
static int holds_out(PyObject *r, PyObject *o, PyObject *scale) {
    if (Py_TYPE(r) != Py_TYPE(o) || !PyTuple_Check(o) || PyTuple_GET_SIZE(r) != 3 || PyTuple_GET_SIZE(o) != 3)
        return 0;
    if (PyTuple_GET_ITEM(r, 0) != PyTuple_GET_ITEM(o, 0)) return 0;
    PyObject *ores = PyTuple_GET_ITEM(o, 1);
    if (ores != Py_None && PyTuple_GET_ITEM(r, 1) != ores) return 0;
    PyObject *rq = PyTuple_GET_ITEM(r, 2), *oq = PyTuple_GET_ITEM(o, 2);
    if (rq == oq) return 1;
    if (oq == Py_None || Py_TYPE(rq) != Py_TYPE(oq) || !PyTuple_Check(oq) || PyTuple_GET_SIZE(rq) != 5 ||
        PyTuple_GET_SIZE(oq) != 5 || PyTuple_GET_ITEM(rq, 0) != PyTuple_GET_ITEM(oq, 0))
        return 0;
    PyObject *rs = PyTuple_GET_ITEM(rq, 1);
    if (rs == PyTuple_GET_ITEM(oq, 1)) return 1;
    return scale != Py_None && rs == scale && PyTuple_GET_ITEM(rq, 4) == Py_None;
}

/* [a, b) and [c, d) share no byte. */
static int apart(u64 a, u64 b, u64 c, u64 d) { return a >= d || c >= b; }

static PyObject *accept(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "accept(state, dispatch, hidden_states, residual, weight, scale, out)");
        return NULL;
    }
    PyObject *state = args[0], *dispatch = args[1], *x = args[2], *res = args[3], *w = args[4], *scale = args[5],
             *out = args[6];
    if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != ST_LEN) {
        PyErr_SetString(PyExc_TypeError, "accept: state is not the op's state tuple");
        return NULL;
    }
    PyObject *result = NULL, *xshape = NULL, *rshape = NULL, *hp_o = NULL, *rp_o = NULL, *wp_o = NULL,
             *sp_o = NULL, *last = NULL, *lastp = NULL, *t_o = NULL;
    int called = 0;
    long long h = PyLong_AsLongLong(PyTuple_GET_ITEM(state, ST_HIDDEN));
    long long row_bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(state, ST_ROW_BYTES));
    long long max_tokens = PyLong_AsLongLong(PyTuple_GET_ITEM(state, ST_MAX_TOKENS));
    long index = PyLong_AsLong(PyTuple_GET_ITEM(state, ST_DEVICE_INDEX));
    if (PyErr_Occurred()) goto decline;
    PyObject *dtype = PyTuple_GET_ITEM(state, ST_DTYPE);
    int on_cpu = PyTuple_GET_ITEM(state, ST_ON_CPU) == Py_True;
    PyObject *token = PyTuple_GET_ITEM(state, ST_TOKEN), *fast_table = PyTuple_GET_ITEM(state, ST_FAST_TABLE);
    if (res == Py_None || PyTuple_GET_ITEM(state, ST_ADD_RESIDUAL) != Py_True) goto decline;
    if (!PyList_CheckExact(token) || PyList_GET_SIZE(token) != 1 || !PyList_CheckExact(fast_table)) goto decline;

    long long t, cols, rt, rc;
    xshape = PyObject_GetAttr(x, s_shape);
    if (xshape == NULL || shape2(xshape, &t, &cols) != 1) goto decline;
    if (t <= 0 || t > max_tokens || cols != h || t >= PyList_GET_SIZE(fast_table)) goto decline;
    PyObject *fast = PyList_GET_ITEM(fast_table, t); /* borrowed; the list holds it */
    if (fast == Py_None) goto decline;
    u64 hp, rp, wp, sp = 0;
    if ((hp_o = data_ptr(x, &hp)) == NULL || (rp_o = data_ptr(res, &rp)) == NULL ||
        (wp_o = data_ptr(w, &wp)) == NULL)
        goto decline;
    if (is_true_method(x, s_is_contiguous) != 1 || is_true_method(res, s_is_contiguous) != 1) goto decline;
    /* A lazy negation (torch._neg_view, z.conj().imag) reads wrong through a pointer: Python rejects it. */
    if (is_true_method(x, s_is_neg) != 0 || is_true_method(res, s_is_neg) != 0) goto decline;
    u64 hn = (u64)t * (u64)row_bytes;
    if ((hp > rp ? hp - rp : rp - hp) < hn) goto decline;
    if (on_device(x, on_cpu, index) != 1 || on_device(res, on_cpu, index) != 1) goto decline;
    if (attr_is(x, s_dtype, dtype) != 1 || attr_is(res, s_dtype, dtype) != 1) goto decline;
    rshape = PyObject_GetAttr(res, s_shape);
    if (rshape == NULL || shape2(rshape, &rt, &rc) != 1 || rt != t || rc != cols) goto decline;
    /* The weight: the last call's (identity and pointer) or one in the trust table. */
    last = PyObject_GetAttr(dispatch, s_last_weight);
    lastp = PyObject_GetAttr(dispatch, s_last_wptr);
    if (last == NULL || lastp == NULL) goto decline;
    u64 lw;
    int wok = (w == last && as_u64(lastp, &lw) == 0 && lw == wp);
    if (PyErr_Occurred()) goto decline;
    if (!wok && trusted(PyTuple_GET_ITEM(state, ST_WEIGHTS), w, wp) != 1) goto decline;
    if (!apart(wp, wp + (u64)row_bytes, hp, hp + hn)) goto decline;
    if (scale != Py_None) {
        if ((sp_o = data_ptr(scale, &sp)) == NULL) goto decline;
        if (trusted(PyTuple_GET_ITEM(state, ST_SCALES), scale, sp) != 1) goto decline;
        if (!apart(sp, sp + 4, hp, hp + hn)) goto decline;
    } else if (PyTuple_GET_ITEM(state, ST_SCALED) == Py_True) {
        goto decline;
    }
    /* Grad mode with an input requiring grad: the Python call guards the result. */
    PyObject *g = PyObject_CallNoArgs(PyTuple_GET_ITEM(state, ST_GRAD_ENABLED));
    if (g == NULL) goto decline;
    int grad = (g == Py_True);
    Py_DECREF(g);
    if (grad && (attr_is(x, s_requires_grad, Py_True) != 0 || attr_is(res, s_requires_grad, Py_True) != 0 ||
                 attr_is(w, s_requires_grad, Py_True) != 0))
        goto decline;
    if (out != Py_None) {
        /* A trusted out for t tokens: each destination kept its pointer and shape (a resize_ that
         * shrinks it keeps the pointer) and meets no input. */
        PyObject *key = PyLong_FromVoidPtr(out);
        if (key == NULL) goto decline;
        PyObject *spans = PyDict_GetItemWithError(PyTuple_GET_ITEM(state, ST_OUT_SPANS), key); /* borrowed */
        Py_DECREF(key);
        if (spans == NULL || !PyTuple_Check(spans) || PyTuple_GET_SIZE(spans) != 2) goto decline;
        Py_INCREF(spans); /* a destination's data_ptr() runs Python code: hold what is read */
        PyObject *rows = PyTuple_GET_ITEM(spans, 0), *dests = PyTuple_GET_ITEM(spans, 1);
        long long n = PyLong_AsLongLong(rows);
        int sok = !PyErr_Occurred() && n == t && PyTuple_Check(dests);
        u64 re = rp + hn, we = wp + (u64)row_bytes, se = scale != Py_None ? sp + 4 : 0;
        for (Py_ssize_t i = 0; sok && i < PyTuple_GET_SIZE(dests); i++) {
            PyObject *e = PyTuple_GET_ITEM(dests, i);
            u64 a, b, p;
            sok = PyTuple_Check(e) && PyTuple_GET_SIZE(e) == 4 && as_u64(PyTuple_GET_ITEM(e, 1), &a) == 0 &&
                  as_u64(PyTuple_GET_ITEM(e, 2), &b) == 0;
            if (!sok) break;
            PyObject *pd = data_ptr(PyTuple_GET_ITEM(e, 0), &p);
            sok = pd != NULL && p == a && apart(a, b, hp, hp + hn) && apart(a, b, rp, re) &&
                  apart(a, b, wp, we) && (scale == Py_None || apart(a, b, sp, se));
            Py_XDECREF(pd);
            if (sok) {
                PyObject *shape = PyObject_GetAttr(PyTuple_GET_ITEM(e, 0), s_shape);
                sok = shape != NULL && PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(e, 3), Py_EQ) == 1;
                Py_XDECREF(shape);
            }
        }
        Py_DECREF(spans);
        if (!sok) goto decline;
    }
    /* Take the op's one-call token (the Python call pops the same list), call, give it back. */
    if (PyList_GET_SIZE(token) != 1 || PyList_SetSlice(token, 0, 1, NULL) < 0) goto decline;
    t_o = PyLong_FromLongLong(t);
    if (t_o != NULL && sp_o == NULL) sp_o = PyLong_FromLong(0);
    if (t_o != NULL && sp_o != NULL) {
        PyObject *call_args[10] = {t_o, x, res, w, scale, out, hp_o, rp_o, wp_o, sp_o};
        Py_INCREF(fast); /* the call runs Python code: hold what was borrowed */
        result = PyObject_Vectorcall(fast, call_args, 10, NULL);
        Py_DECREF(fast);
        called = 1;
    }
    {
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *exc = PyErr_GetRaisedException();
        int appended = PyList_Append(token, Py_None);
        PyErr_SetRaisedException(exc);
#else
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        int appended = PyList_Append(token, Py_None);
        PyErr_Restore(et, ev, etb);
#endif
        if (appended < 0 && result != NULL) Py_CLEAR(result); /* out of memory: report it */
    }
    if (called && result == NULL) goto done; /* the backend raised: the caller sees its error */
    if (result != NULL && result != Py_None && out != Py_None && !holds_out(result, out, scale)) {
        /* The backend ran (no declining now): the Python call checks this result in full. */
        PyObject *wrapped = PyTuple_Pack(1, result);
        Py_DECREF(result);
        result = wrapped; /* NULL: out of memory, reported */
        goto done;
    }
    if (result != NULL) goto done; /* None when the backend declined: __call__ serves the call */
decline:
    /* A check that raised is a declined call (the Python call decides and raises what it must),
       unless it was not an ordinary error (KeyboardInterrupt, SystemExit: let it through). */
    if (PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
            result = Py_NewRef(Py_NotImplemented);
        }
    } else {
        result = Py_NewRef(Py_NotImplemented);
    }
done:
    Py_XDECREF(xshape);
    Py_XDECREF(rshape);
    Py_XDECREF(hp_o);
    Py_XDECREF(rp_o);
    Py_XDECREF(wp_o);
    Py_XDECREF(sp_o);
    Py_XDECREF(last);
    Py_XDECREF(lastp);
    Py_XDECREF(t_o);
    return result;
}

static PyMethodDef methods[] = {
    {"accept", (PyCFunction)(void (*)(void))accept, METH_FASTCALL,
     "accept(state, dispatch, hidden_states, residual, weight, scale, out): the fast path's result, or "
     "NotImplemented when the Python call must run."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef accel_module = {
    PyModuleDef_HEAD_INIT, "_arnorm_accel", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__arnorm_accel(void) {
    s_shape = PyUnicode_InternFromString("shape");
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_is_contiguous = PyUnicode_InternFromString("is_contiguous");
    s_get_device = PyUnicode_InternFromString("get_device");
    s_dtype = PyUnicode_InternFromString("dtype");
    s_requires_grad = PyUnicode_InternFromString("requires_grad");
    s_is_cpu = PyUnicode_InternFromString("is_cpu");
    s_last_weight = PyUnicode_InternFromString("last_weight");
    s_last_wptr = PyUnicode_InternFromString("last_wptr");
    s_is_neg = PyUnicode_InternFromString("is_neg");
    if (!s_shape || !s_data_ptr || !s_is_contiguous || !s_get_device || !s_dtype || !s_requires_grad ||
        !s_is_cpu || !s_last_weight || !s_last_wptr || !s_is_neg)
        return NULL;
    return PyModule_Create(&accel_module);
}
