"""TLS between every process and the scheduler (reference 001; tlsconfig.py, control/tls.py).

Real certificates made by `trainguard certs` and its functions, a real `trainguard scheduler` process,
real sockets: a job recovers from kill -9 over mutual TLS, bit-identical; a client whose certificate
is from another CA, revoked, expired or not yet valid is refused, and both sides say why; so is a
client offering only a cipher outside the list, one without TLS, and a scheduler from another CA.
Certificates that are bad at start end the process at once, naming the file; one that expires soon
is a warning naming the file and the days left."""

from __future__ import annotations

import datetime as dt
import json
import logging
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import assert_identical, env, events, finals, free_port, job_args, wait_for

from trainguard import tlsconfig
from trainguard.control import tls
from trainguard.control.client import Connection, query_status
from trainguard.errors import AuthenticationFailed, ConfigError
from trainguard.exitcodes import EXIT_CONFIG
from trainguard.launch import certs

pytestmark = pytest.mark.timeout(180)
SECRET = "the secret of the TLS tests, long enough"


def tls_env(config: Path) -> dict[str, str]:
    d = config.parent
    return {"TG_ENABLE_SSL": "1", "TG_SSL_CONFIG": str(config), "TG_SERVER_PASSWORD_FILE": str(d / "server.password"),
            "TG_CLIENT_PASSWORD_FILE": str(d / "client.password")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA with its server and client certificates (trainguard certs), and strangers' certificates:
    from another CA, revoked (in the CA's CRL), expired, not yet valid."""
    d = tmp_path_factory.mktemp("pki")
    config = certs.make_test_pki(d / "ca")
    ca_key = certs.load_key(d / "ca" / "ca.key")
    from cryptography import x509

    ca = x509.load_pem_x509_certificate((d / "ca" / "ca.crt").read_bytes())
    now = dt.datetime.now(dt.timezone.utc)
    bad = {"good": certs.issue(ca_key, ca, "good client", server=False),
           "revoked": certs.issue(ca_key, ca, "revoked client", server=False),
           "expired": certs.issue(ca_key, ca, "expired client", server=False, not_before=now - dt.timedelta(days=30),
                                  days=10),
           "not-yet-valid": certs.issue(ca_key, ca, "future client", server=False,
                                        not_before=now + dt.timedelta(days=2))}
    other_key, other_ca = certs.make_ca("another CA")
    bad["other-CA"] = certs.issue(other_key, other_ca, "foreign client", server=False)
    (d / "ca" / "crl.pem").unlink()
    certs.write(d / "ca" / "crl.pem", certs.crl(ca_key, ca, [bad["revoked"][1].serial_number]))
    pems = {}
    for name, (key, cert) in bad.items():
        (d / f"{name}.pem").write_bytes(certs.key_pem(key) + certs.pem(cert))
        pems[name] = d / f"{name}.pem"
    other = certs.make_test_pki(d / "other")  # a whole other cluster: its scheduler is a stranger to us
    return {"config": config, "pems": pems, "other": other, "dir": d}


def client_ctx(pki, name: str, **kw) -> ssl.SSLContext:
    """A client context with one of the strangers' certificates (built by hand: ours refuse to load them)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(pki["config"].parent / "ca.crt"))
    ctx.load_cert_chain(str(pki["pems"][name]))
    if "ciphers" in kw:
        ctx.set_ciphers(kw.pop("ciphers"))
    for key, value in kw.items():  # e.g. maximum_version
        setattr(ctx, key, value)
    return ctx


@pytest.fixture(scope="module")
def scheduler(pki, tmp_path_factory):
    """A real `trainguard scheduler` process with TLS and a job secret; its log is read by the tests."""
    log = tmp_path_factory.mktemp("sched") / "scheduler.log"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "scheduler", "--host", "127.0.0.1", "--port",
                             str(port), "--workers", "2"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env(TG_JOB_SECRET=SECRET, **tls_env(pki["config"])))
    address = ("127.0.0.1", port)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in tls_env(pki["config"]).items():
                mp.setenv(k, v)
            wait_for(lambda: _answers(address), 30, "the TLS scheduler to answer")
        yield address, log
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(address) -> bool:
    try:
        query_status(address, timeout=2, secret=SECRET.encode())
        return True
    except (ConnectionError, OSError):
        return False


def refused_with(scheduler, ctx, client_says: str, scheduler_says: str) -> None:
    address, log = scheduler
    before = len(log.read_text())
    with pytest.raises(AuthenticationFailed, match=client_says):
        Connection(address, 5, SECRET.encode(), tls_context=ctx)
    wait_for(lambda: scheduler_says in log.read_text()[before:], 10, f"the scheduler to log {scheduler_says!r}")


# --- a job over TLS ------------------------------------------------------------------------------------


def test_a_job_recovers_over_mutual_tls_bit_identical(tmp_path, pki, baseline_runs):
    """`trainguard run --ssl-config`: the scheduler, both workers, the replacement and the agent all speak TLS
    (the scheduler accepts nothing else); rank 1 is killed with kill -9 after step 6."""
    d = pki["config"].parent
    cmd = [sys.executable, "-m", "trainguard", "run", "--workers", "2", "--max-restarts", "3", "--ssl-config",
           str(pki["config"]), "--recovery-path", str(tmp_path / "recovery"), *job_args(tmp_path)]
    proc = subprocess.run(cmd, env=env(TG_FAULT="1:6:kill", TG_SERVER_PASSWORD_FILE=str(d / "server.password"),
                                       TG_CLIENT_PASSWORD_FILE=str(d / "client.password")),
                          capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "TLS on" in out
    got, want = finals(tmp_path, 2), baseline_runs(2)
    for rank in range(2):
        assert_identical(got[rank], want[rank], f"rank {rank}")
    ev = events(tmp_path)
    assert any(e["event"] == "registered" and e["node"] == "1" and e["incarnation"] == 2 for e in ev)
    assert not [e for e in ev if e["event"] == "connection_refused"], ev


# --- who is refused, and what each side says --------------------------------------------------------------


@pytest.mark.parametrize("name,client_says,scheduler_says", [
    ("other-CA", "not issued by its CA", "unable to get local issuer certificate (it is not from this CA"),
    ("revoked", "revoked", "certificate revoked"),
    ("expired", "expired", "certificate has expired"),
    ("not-yet-valid", "not yet valid", "certificate is not yet valid"),
])
def test_a_bad_client_certificate_is_refused_and_both_sides_say_why(pki, scheduler, name, client_says,
                                                                    scheduler_says):
    refused_with(scheduler, client_ctx(pki, name), client_says, scheduler_says)


def test_a_cipher_outside_the_list_and_a_client_without_tls_are_refused(pki, scheduler):
    Connection(scheduler[0], 5, SECRET.encode(), tls_context=client_ctx(pki, "good")).close()  # the certificate is fine
    cbc_only = client_ctx(pki, "good", maximum_version=ssl.TLSVersion.TLSv1_2, ciphers="ECDHE-ECDSA-AES128-SHA")
    refused_with(scheduler, cbc_only, "no cipher", "TLS: no cipher")
    with pytest.raises(AuthenticationFailed, match="requires TLS.*TG_ENABLE_SSL=1"):
        Connection(scheduler[0], 5, SECRET.encode(), tls_context=None)
    ours = tls.client_context(tlsconfig.read(tls_env(pki["config"])))
    Connection(scheduler[0], 5, SECRET.encode(), tls_context=ours).close()  # and ours gets in


def test_a_client_refuses_a_scheduler_of_another_ca(pki, scheduler):
    theirs = tls.client_context(tlsconfig.read(tls_env(pki["other"])))
    refused_with(scheduler, theirs, "the scheduler's certificate was refused: .* .it is not from this CA",
                 "TLS: ")


def test_a_tls_client_refuses_a_scheduler_without_tls(pki):
    from trainguard.config import ClusterConfig, LaunchMode, Role
    from trainguard.control.sched_main import start_in_thread

    sched, _ = start_in_thread(ClusterConfig(role=Role.SCHEDULER, mode=LaunchMode.DYNAMIC, sched_host="127.0.0.1",
                                             sched_port=0, worker_num=1, secret=SECRET.encode()))
    ours = tls.client_context(tlsconfig.read(tls_env(pki["config"])))
    with pytest.raises(AuthenticationFailed, match="does not offer TLS.*refusing to talk in the clear"):
        Connection(("127.0.0.1", sched.port), 5, SECRET.encode(), tls_context=ours)


# --- at start --------------------------------------------------------------------------------------------


def _config(tmp_path: Path, pki, **changes) -> dict[str, str]:
    base = json.loads(pki["config"].read_text())
    for key in ("server_cert_path", "client_cert_path", "ca_cert_path", "crl_path"):
        base[key] = str(pki["config"].parent / base[key])
    base.update(changes)
    path = tmp_path / "ssl.json"
    path.write_text(json.dumps({k: v for k, v in base.items() if v is not None}))
    return tls_env(path) | {"TG_SERVER_PASSWORD_FILE": str(pki["config"].parent / "server.password"),
                            "TG_CLIENT_PASSWORD_FILE": str(pki["config"].parent / "client.password")}


def test_bad_settings_are_refused_at_start_naming_the_key_or_file(tmp_path, pki):
    with pytest.raises(ConfigError, match="TG_SSL_CONFIG is set but TG_ENABLE_SSL is not"):
        tlsconfig.read({"TG_SSL_CONFIG": "x.json"})
    with pytest.raises(ConfigError, match="TG_ENABLE_SSL=1 needs TG_SSL_CONFIG"):
        tlsconfig.read({"TG_ENABLE_SSL": "1"})
    with pytest.raises(ConfigError, match="unknown key 'server_cert'"):
        tlsconfig.read(_config(tmp_path, pki, server_cert="x"))
    with pytest.raises(ConfigError, match="ca_cert_path is missing"):
        tlsconfig.read(_config(tmp_path, pki, ca_cert_path=None))
    with pytest.raises(ConfigError, match="client_cert_path '.*nope.p12': No such file"):
        tlsconfig.read(_config(tmp_path, pki, client_cert_path="nope.p12"))
    with pytest.raises(ConfigError, match="cert_expire_warning_time_in_day"):
        tlsconfig.read(_config(tmp_path, pki, cert_expire_warning_time_in_day="ninety"))
    wrong = _config(tmp_path, pki) | {"TG_SERVER_PASSWORD": "wrong", "TG_SERVER_PASSWORD_FILE": ""}
    with pytest.raises(ConfigError, match="server.p12: cannot open this PKCS#12 file: the password is wrong"):
        tls.server_context(tlsconfig.read(wrong))
    with pytest.raises(ConfigError, match="cipher_list names no cipher"):
        tls.server_context(tlsconfig.read(_config(tmp_path, pki, cipher_list="NOT-A-CIPHER")))
    other_crl = str(pki["other"].parent / "crl.pem")
    with pytest.raises(ConfigError, match="crl.pem: this CRL is not signed by a CA in"):
        tls.client_context(tlsconfig.read(_config(tmp_path, pki, crl_path=other_crl)))
    with pytest.raises(ConfigError, match="client.p12: its certificate .* was not issued by a CA in"):
        tls.client_context(tlsconfig.read(_config(tmp_path, pki, ca_cert_path=str(pki["other"].parent / "ca.crt"),
                                                  crl_path=None)))


def test_an_expired_own_certificate_ends_the_scheduler_at_once(tmp_path, pki):
    key, cert = pki_issue(pki, server=True, days=1, not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3))
    (tmp_path / "old.p12").write_bytes(certs.p12(key, cert, b"pw"))
    cfg = _config(tmp_path, pki, server_cert_path=str(tmp_path / "old.p12")) | {
        "TG_SERVER_PASSWORD": "pw", "TG_SERVER_PASSWORD_FILE": ""}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "trainguard", "scheduler", "--host", "127.0.0.1", "--port",
                           str(free_port()), "--workers", "1"], env=env(TG_JOB_SECRET=SECRET, **cfg),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CONFIG, proc.stderr  # refused at start, never restarted
    assert "old.p12: the certificate (CN=trainguard server) is expired on" in proc.stderr
    assert time.monotonic() - t0 < 30  # no retry: a certificate does not get better by waiting


def test_a_certificate_close_to_expiry_is_a_warning_naming_it(tmp_path, pki, caplog):
    key, cert = pki_issue(pki, server=False, days=10)
    (tmp_path / "soon.p12").write_bytes(certs.p12(key, cert, b"pw"))
    cfg = _config(tmp_path, pki, client_cert_path=str(tmp_path / "soon.p12")) | {
        "TG_CLIENT_PASSWORD": "pw", "TG_CLIENT_PASSWORD_FILE": ""}
    with caplog.at_level(logging.WARNING, logger="trainguard.tls"):
        tls.client_context(tlsconfig.read(cfg))
    assert any("soon.p12" in r.message and "expires in 9 days" in r.message for r in caplog.records), caplog.text


def test_trainguard_certs_never_overwrites(tmp_path):
    config = certs.make_test_pki(tmp_path / "pki")
    before = {p.name: p.read_bytes() for p in config.parent.iterdir()}
    proc = subprocess.run([sys.executable, "-m", "trainguard", "certs", str(config.parent)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "already holds ca.crt" in proc.stderr
    assert {p.name: p.read_bytes() for p in config.parent.iterdir()} == before
    assert oct((config.parent / "client.password").stat().st_mode & 0o777) == "0o600"


def pki_issue(pki, *, server: bool, days: int, not_before=None):
    from cryptography import x509

    d = pki["config"].parent
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    return certs.issue(certs.load_key(d / "ca.key"), ca, f"trainguard {'server' if server else 'client'}",
                       server=server, days=days, not_before=not_before)
