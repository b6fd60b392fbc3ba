# The TensorHub control protocol: the core's requests, reports and effects (core/messages.h) as
# Cap'n Proto structs, and the three interfaces that carry them between th-server and libthclient.
#
# The wire mirrors the core types field for field; net/wire.h converts and validates. Nothing here
# decides anything: a message the core would not accept is refused by net/wire.cpp with a typed
# error before it reaches the Hub.
@0xf11c2dcadf91ad90;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("th::wire");

# ---- Values -------------------------------------------------------------------------------------

struct Selector {
  union {
    absolute @0 :UInt64;     # version N
    latestMinus @1 :UInt64;  # latest-k (latest is latest-0)
  }
}

struct TensorSpec {
  name @0 :Text;
  dtype @1 :UInt8;   # th::DType
  bytes @2 :UInt64;
  kind @3 :UInt8;    # th::TensorKind: 0 bytes (what senders before it meant), 1 local, 2 piece
  shape @4 :List(UInt64);
  boxOffset @5 :List(UInt64);  # pieces only
  boxExtent @6 :List(UInt64);
}

struct Retention {
  keepLatest @0 :UInt64;
  hasKeepLatest @1 :Bool;
  pinned @2 :List(UInt64);
}

struct WaitPredicate {
  kind @0 :UInt8;  # th::WaitPredicate::Kind
  version @1 :UInt64;
  replicasMin @2 :UInt32;
  role @3 :Text;
}

struct OpKey {
  kind @0 :UInt8;  # th::OpKind
  selector @1 :Selector;
  version @2 :UInt64;
  predicate @3 :WaitPredicate;
}

struct Error {
  code @0 :UInt8;  # th::Errc
  detail @1 :Text;
}

struct ListSnapshot {
  struct VersionInfo {
    version @0 :UInt64;
    complete @1 :UInt32;
    partial @2 :UInt32;
    retained @3 :Bool;
    offloaded @4 :Bool;
  }
  struct ReplicaInfo {
    name @0 :Text;
    incarnation @1 :UInt64;
    datacenter @2 :Text;
    spot @3 :Bool;
    role @4 :Text;
    numShards @5 :UInt32;
    state @6 :Text;
    version @7 :UInt64;
    hasVersion @8 :Bool;
    serving @9 :UInt32;
    offloads @10 :List(UInt64);
  }
  model @0 :Text;
  latest @1 :UInt64;
  hasLatest @2 :Bool;
  versions @3 :List(VersionInfo);
  replicas @4 :List(ReplicaInfo);
}

struct Outcome {
  union {
    error @0 :Error;
    openOk :group { numShards @1 :UInt32; latest @2 :UInt64; hasLatest @3 :Bool; incarnation @15 :UInt64; }
    publishOk @4 :UInt64;  # the version
    unpublishOk @5 :Void;
    replicateOk :group { version @6 :UInt64; sourceReplica @7 :Text; }
    updateOk :group {
      status @8 :UInt8;
      version @9 :UInt64;
      sourceReplica @10 :Text;
      holding @14 :Bool;  # false: the replica holds nothing (version is then meaningless)
    }
    listOk @11 :ListSnapshot;
    waitOk @12 :Void;
    closeOk @13 :Void;
  }
}

struct HeldCopy {
  version @0 :UInt64;
  layout @1 :List(TensorSpec);
  checksums @2 :List(UInt64);
  copy @3 :UInt64;  # an offload copy: the id the server that made it gave it
  patch @4 :PatchInfo;  # a primary's patch of the version that the shard keeps (unset: none)
}

# A shard's patch of a version against an earlier one (core/types.h PatchInfo): per tensor in layout
# order the bytes of its patch, 0 for a tensor that has none (read whole).
struct PatchInfo {
  base @0 :UInt64;
  tensorBytes @1 :List(UInt64);
}

struct TxnRecord {
  seq @0 :UInt64;
  op @1 :OpKey;
  outcome @2 :Outcome;
}

struct Resume {
  primary @0 :HeldCopy;
  hasPrimary @1 :Bool;
  offloads @2 :List(HeldCopy);
  lastTxn @3 :TxnRecord;
  hasLastTxn @4 :Bool;
}

# ---- Client to server ---------------------------------------------------------------------------

struct OpenRequest {
  model @0 :Text;
  replica @1 :Text;
  incarnation @2 :UInt64;
  shard @3 :UInt32;
  numShards @4 :UInt32;
  datacenter @5 :Text;
  spot @6 :Bool;
  role @7 :Text;
  retention @8 :Retention;
  dataEndpoint @9 :Text;
  resume @10 :Resume;
  hasResume @11 :Bool;
  incarnationAuto @12 :Bool;  # the server chooses the incarnation (see core/messages.h)
}

struct Request {
  client @0 :UInt64;
  seq @1 :UInt64;
  session @2 :UInt64;
  body :union {
    open @3 :OpenRequest;
    publish :group {
      version @4 :UInt64; layout @5 :List(TensorSpec); checksums @6 :List(UInt64);
      patch @17 :PatchInfo;  # against the version published before (unset: none)
    }
    unpublish @7 :Void;
    replicate :group { selector @8 :Selector; layout @9 :List(TensorSpec); timeoutMs @10 :Int64; }
    update :group { selector @11 :Selector; layout @12 :List(TensorSpec); }
    list @13 :Void;
    wait :group { predicate @14 :WaitPredicate; timeoutMs @15 :Int64; }
    close @16 :Void;
  }
}

struct Report {
  client @0 :UInt64;
  session @1 :UInt64;
  body :union {
    heartbeat @2 :Void;
    # checksums: after a read from another layout, of the tensors as the shard assembled them
    transferDone :group { transfer @3 :UInt64; epoch @4 :UInt32; checksums @11 :List(UInt64); }
    transferFailed :group { transfer @5 :UInt64; epoch @6 :UInt32; reason @7 :UInt8; }
    offloadDone @8 :UInt64;  # the version
    cancelCall @10 :UInt64;  # the sequence number of the call the application gave up
    # bytes: of the shard, moved from this epoch's source so far (sent once, early in the read)
    transferProgress :group { transfer @12 :UInt64; epoch @13 :UInt32; bytes @14 :UInt64; }
  }
  offloadCopy @9 :UInt64;  # offloadDone: the copy, as the offload instruction named it
}

struct ToHub {
  union {
    request @0 :Request;
    report @1 :Report;
  }
}

# ---- Server to client ---------------------------------------------------------------------------

struct SourceRef {
  replica @0 :Text;
  incarnation @1 :UInt64;
  datacenter @2 :Text;
  endpoint @3 :Text;
  kind @4 :UInt8;  # th::CopyKind
  partial @5 :Bool;
}

# A shard of a source replica of another layout than the reader's.
struct SourceShard {
  endpoint @0 :Text;
  layout @1 :List(TensorSpec);
  checksums @2 :List(UInt64);
}

struct Effect {
  client @0 :UInt64;
  session @1 :UInt64;
  message :union {
    reply :group {
      seq @2 :UInt64;
      outcome @3 :Outcome;
      replicaIncarnation @4 :UInt64;
      toOpen @23 :Bool;  # the answer to an open, not to call seq
      released @28 :Bool;  # a failed replicate/update: the replica's held version no longer counts
    }
    startRead :group {
      transfer @5 :UInt64;
      epoch @6 :UInt32;
      version @7 :UInt64;
      shard @8 :UInt32;
      source @9 :SourceRef;
      checksums @10 :List(UInt64);
      call @24 :UInt64;  # the reader's call this transfer serves
      offloadCopy @26 :UInt64;  # offload seeding: read into this new CPU copy (0: the buffers)
      layout @27 :List(TensorSpec);  # offload seeding: the layout of that copy
      grantSecret @29 :Data;  # 16 bytes: what the source asks of this transfer's reads
      reshard @31 :List(SourceShard);  # a source of another layout: all its shards (else empty)
      patch @33 :PatchInfo;  # read this patch against the version the buffers hold (unset: the bytes)
    }
    serveRead :group {
      transfer @11 :UInt64;
      epoch @12 :UInt32;
      version @13 :UInt64;
      kind @14 :UInt8;
      shard @15 :UInt32;
      readerReplica @16 :Text;
      grantSecret @30 :Data;  # 16 bytes: serve only reads that present it (a capability)
      patch @34 :Bool;  # serve the shard's patch of the version too
    }
    stopServing :group { transfer @17 :UInt64; epoch @18 :UInt32; }
    offload @19 :UInt64;         # the version
    releaseOffload @20 :UInt64;  # the version
    evicted :group { reason @21 :UInt8; detail @22 :Text; }
    copyCorrupt @32 :UInt64;     # the version: readers found this shard's copy failing its checksums
  }
  offloadCopy @25 :UInt64;  # offload, releaseOffload, copyCorrupt: the copy they name (copyCorrupt: 0 for the buffers)
}

# ---- Interfaces ---------------------------------------------------------------------------------

# What a client process hands the server at connect: the server pushes effects through it.
interface Sink {
  deliver @0 (effects :List(Effect)) -> ();
}

# A connection's session with the hub, after the cluster token was accepted.
interface Session {
  # Requests and reports of the client handles of this connection. Returns once the server has
  # fed them to the hub; the client keeps a bounded number of these calls in flight.
  #
  # heartbeatDatagramsHeard: the server has lately received this connection's heartbeats as UDP
  # datagrams (see HeartbeatChannel), so the client may stop sending them as calls.
  send @0 (messages :List(ToHub)) -> (heartbeatDatagramsHeard :Bool);
}

# Where and how to send heartbeats as one-way UDP datagrams (net/heartbeat.h) instead of calls: a
# call costs the server ~60 us of CPU, a datagram ~1 us. port 0: the server takes calls only.
struct HeartbeatChannel {
  port @0 :UInt16;     # UDP, on the host the client connected to
  secret @1 :UInt64;   # unused since key (format 1 sent it in clear in every datagram)
  key @2 :Data;        # 16 bytes: the SipHash key that seals this connection's datagrams
}

# What th-ctl shows: counters of the server since it started.
struct ServerStats {
  requests @0 :UInt64;
  reports @1 :UInt64;
  transfersStarted @2 :UInt64;
  transfersCompleted @3 :UInt64;
  sourceFailures @4 :UInt64;
  offloadsStarted @5 :UInt64;
  evictions @6 :UInt64;
  clients @7 :UInt64;
  connections @8 :UInt64;
  uptimeMs @9 :Int64;
  heartbeatDatagrams @10 :UInt64;         # accepted
  heartbeatDatagramsRefused @11 :UInt64;  # malformed, unknown client, wrong MAC or replayed
  heartbeatCalls @12 :UInt64;             # heartbeats that came as Session.send messages
}

# The bootstrap capability of th-server.
interface Hub {
  # Authenticates the connection with the cluster token. Refused (an exception of type FAILED with a
  # reason) for a wrong token; a connection that presents wrong tokens repeatedly is closed.
  #
  # client, clientSecret: the one client handle this connection speaks for (Session.send refuses
  # messages naming any other). The secret (at least 16 random bytes, kept by the handle for its
  # lifetime) proves a reconnecting handle is the one that holds the id: a connect naming a client
  # bound to another live connection takes it over only with the same secret. client 0: a connection
  # that sends no messages (inspect-only tools).
  #
  # heartbeatTimeoutMs: how long the server waits for a client's heartbeat before it evicts it
  # (the client bounds its own waits on peers by it).
  connect @0 (token :Text, sink :Sink, clientName :Text, client :UInt64, clientSecret :Data)
      -> (session :Session, heartbeats :HeartbeatChannel, heartbeatTimeoutMs :Int64);

  # Every model's listing and the server's counters (th-ctl). Same token as connect.
  inspect @1 (token :Text) -> (models :List(ListSnapshot), stats :ServerStats);

  # The transfer timeline (th-ctl timeline): the last transfers the server keeps, as Chrome Trace
  # Event JSON (server/chrome_trace.h); only `model`'s when it is set. Same token as connect.
  timeline @2 (token :Text, model :Text) -> (json :Text);
}

# ---- Framed connections (net/frames.h) -----------------------------------------------------------
# libthclient's control connection: after the 8 bytes of net::kFramedMagic, each side sends Cap'n
# Proto messages in the standard stream framing, back to back, with no RPC and no per-message
# return: sequence numbers already acknowledge and de-duplicate calls, and TCP orders and delivers
# while the connection lives. Each side batches what one turn of its loop produced into one write.

# What the client sends. The first frame is `hello`; then `messages` frames.
struct ClientFrame {
  union {
    hello @0 :Hello;
    messages @1 :List(ToHub);  # at most net::kMessagesPerCallMax; empty: a probe (see `ack`)
  }
  # Nonzero: answer with a ServerFrame carrying this `ack` once the frame has been fed to the hub.
  # The client's evidence that the server is alive (an empty `messages` frame with an ack is a
  # quiet client's probe, which the server also counts as a heartbeat).
  ack @2 :UInt64;
}

struct Hello {
  token @0 :Text;
  clientName @1 :Text;
  client @2 :UInt64;       # as Hub.connect
  clientSecret @3 :Data;
}

# What the server sends. The first frame answers hello: `welcome`, or `refused` and the connection
# closes.
struct ServerFrame {
  union {
    welcome :group {
      heartbeats @0 :HeartbeatChannel;
      heartbeatTimeoutMs @1 :Int64;
    }
    refused @2 :Text;  # before welcome: why the hello was refused (then the server closes)
    effects @3 :List(Effect);
    notice @4 :Text;   # after welcome: a message of the last frames was refused (a bug or a version skew)
    goingAway @7 :Text;  # the server is shutting down (why): fail over to the next server now; the
                         # connection closes after this frame
  }
  ack @5 :UInt64;                      # the client's latest `ack` fed to the hub (0: none)
  heartbeatDatagramsHeard @6 :Bool;    # with an ack: as Session.send's reply
}
