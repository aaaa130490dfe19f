{{/* The prefill and decode Deployments share this; each is called with (list $ "prefill")
     or (list $ "decode"). */}}

{{- define "pd-appliance.tp" -}}
{{- $m := (index . 0).Values.model -}}
{{- $own := ternary $m.prefillTpSize $m.decodeTpSize (eq (index . 1) "prefill") -}}
{{- $own | default $m.tpSize | int -}}
{{- end -}}

{{/* The KV transfer's protocol: transfer.protocol, or for auto rdma on the gpu stack when an
     RDMA resource is named, else tcp. */}}
{{- define "pd-appliance.protocol" -}}
{{- $t := .Values.transfer -}}
{{- if ne $t.protocol "auto" -}}{{ $t.protocol }}
{{- else if and (eq .Values.stack "gpu") $t.rdmaResource.name -}}rdma
{{- else -}}tcp
{{- end -}}
{{- end -}}

{{/* A role's RDMA devices, comma-joined (Mooncake's device_name: per GPU the nearest; the
     preflight's PD_RDMA_DEVICE): its own list, else transfer.device; "" over tcp.
     Call with (list $ "prefill"). */}}
{{- define "pd-appliance.rdmaDevices" -}}
{{- $ctx := index . 0 -}}
{{- $t := $ctx.Values.transfer -}}
{{- if eq (include "pd-appliance.protocol" $ctx) "rdma" -}}
{{- $own := index $t (printf "%sDevices" (index . 1)) | default list -}}
{{- if $own }}{{ join "," $own }}{{ else }}{{ $t.device }}{{ end -}}
{{- end -}}
{{- end -}}

{{/* The interface whose address the side channel and Mooncake advertise: network.kvInterface,
     else net1 (Multus' first attachment) with a Multus network; "": the pod IP. */}}
{{- define "pd-appliance.kvInterface" -}}
{{- $n := .Values.network -}}
{{- $n.kvInterface | default (ternary "net1" "" (ne ($n.multus | default "") "")) -}}
{{- end -}}

{{/* The connector's settings (appliance/connector/settings.py), as one JSON argument.
     Kubernetes expands $(POD_NAME) and $(POD_IP) from the container's env. */}}
{{- define "pd-appliance.kvTransferConfig" -}}
{{- $v := (index . 0).Values -}}
{{- $role := index . 1 -}}
{{- $keys := include "pd-appliance.keysDir" (index . 0) -}}
{{- /* appliance.deadlines: D waits longer than the proxy, P holds KV longer than D waits. */ -}}
{{- $recv := $v.timeouts.kvRecvS | default (addf $v.timeouts.prefillS $v.timeouts.kvTransferS) -}}
{{- $send := $v.timeouts.kvSendS | default (addf $recv $v.timeouts.kvTransferS) -}}
{{- /* With a KV interface appliance.kvhost puts its address in `host` at start. */ -}}
{{- $extra := dict "protocol" (include "pd-appliance.protocol" (index . 0)) "device_name" (include "pd-appliance.rdmaDevices" .) "host" "$(POD_IP)" "recv_timeout_s" $recv "bootstrap_token_file" (printf "%s/bootstrap-token" $keys) "side_channel_key_file" (printf "%s/side-channel.key" $keys) -}}
{{- if eq $role "prefill" -}}
{{- /* The port, not a URL: the connector builds it from the pod IP (brackets for IPv6). */ -}}
{{- $_ := set $extra "bootstrap_port" (int $v.ports.bootstrap) -}}
{{- $_ := set $extra "send_timeout_s" $send -}}
{{- with $v.transfer.internalNetworks }}{{ $_ := set $extra "internal_networks" . }}{{ end -}}
{{- else -}}
{{- /* D pulls only from sidecars on the pod network (the proxy names P's by pod IP). */ -}}
{{- with $v.podNetworkCidrs }}{{ $_ := set $extra "allowed_bootstrap_networks" . }}{{ end -}}
{{- end -}}
{{- $role_ := ternary "kv_producer" "kv_consumer" (eq $role "prefill") -}}
{{- toJson (dict "kv_connector" "PDConnector" "kv_connector_module_path" "appliance.connector.facade" "kv_role" $role_ "engine_id" "$(POD_NAME)" "kv_load_failure_policy" "recompute" "kv_connector_extra_config" $extra) -}}
{{- end -}}

{{/* How long vLLM drains on SIGTERM: the grace period less preStop's sleep and 10 s to
     exit (the schema keeps it >= 5). Call with (list $ "prefill"). */}}
{{- define "pd-appliance.shutdownTimeout" -}}
{{- $r := index (index . 0).Values (index . 1) -}}
{{- sub (sub (int $r.terminationGracePeriodSeconds) (int $r.preStopSleepS)) 10 -}}
{{- end -}}

{{/* preStop: sleep while the endpoints drop the pod, so nothing new arrives after SIGTERM
     (the images have coreutils' sleep). */}}
{{- define "pd-appliance.preStopSleep" -}}
lifecycle:
  preStop:
    exec:
      command: [sleep, {{ . | int | quote }}]
{{- end -}}

{{/* vLLM's command line after the image's entrypoint (which runs the RDMA preflight: so
     `args`, never `command`); through appliance.kvhost with a KV interface. */}}
{{- define "pd-appliance.vllmArgs" -}}
{{- $ctx := index . 0 -}}
{{- $role := index . 1 -}}
{{- $v := $ctx.Values -}}
{{- $m := $v.model -}}
{{- $args := list "python3" "-m" "appliance.launcher" "serve" $m.path
      "--served-model-name" ($m.servedName | default (base $m.path))
      "--host" "$(POD_IP)" "--port" (toString (int (index $v.ports $role))) -}}
{{- if eq $role "decode" -}}
{{- $args = concat $args (list "--middleware" "appliance.connector.httpguard.KVParamsGuard") -}}
{{- $chunk := include "pd-appliance.decodePrefillChunk" $ctx | int64 -}}
{{- if gt $chunk 0 }}{{ $args = concat $args (list "--long-prefill-token-threshold" (toString $chunk)) }}{{ end -}}
{{- end -}}
{{- $stepTokens := ternary (ternary 256 0 (eq $v.stack "cpu")) $m.maxNumBatchedTokens (kindIs "invalid" $m.maxNumBatchedTokens) -}}
{{- if gt (int64 $stepTokens) 0 }}{{ $args = concat $args (list "--max-num-batched-tokens" (toString (int64 $stepTokens))) }}{{ end -}}
{{- $args = concat $args (list "--tensor-parallel-size" (include "pd-appliance.tp" .)
      "--block-size" (include "pd-appliance.blockSize" $ctx)
      "--gpu-memory-utilization" (toString $m.gpuMemoryUtilization)) -}}
{{- with $m.maxModelLen }}{{ $args = concat $args (list "--max-model-len" (toString (int64 .))) }}{{ end -}}
{{- with $m.kvCacheBytes }}{{ $args = concat $args (list "--kv-cache-memory-bytes" (toString (int64 .))) }}{{ end -}}
{{- /* SIGTERM: finish what is in flight (vLLM's default 0 aborts it all). */ -}}
{{- $args = concat $args (list "--shutdown-timeout" (include "pd-appliance.shutdownTimeout" .)) -}}
{{- /* KV events for the proxy's prefix index: bound on the pod IP (VLLM_HOST_IP) at ports
       vLLM picks and lists at /kv_event_sources, never on every interface. */ -}}
{{- $args = concat $args (list "--prefix-caching-hash-algo" "sha256_cbor" "--kv-events-config"
      "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:0\",\"replay_endpoint\":\"tcp://*:0\"}") -}}
{{- $args = concat $args (list "--kv-transfer-config" (include "pd-appliance.kvTransferConfig" .)) -}}
{{- with $v.tracing.otlpEndpoint }}{{ $args = concat $args (list "--otlp-traces-endpoint" .) }}{{ end -}}
{{- $args = concat $args $m.extraArgs (ternary $m.prefillExtraArgs $m.decodeExtraArgs (eq $role "prefill")) -}}
{{- with (include "pd-appliance.kvInterface" $ctx) }}{{ $args = concat (list "python3" "-m" "appliance.kvhost" "--interface" . "--") $args }}{{ end -}}
{{- toYaml $args -}}
{{- end -}}

{{/* GPUs (= TP) on the gpu stack, whole CPUs on the cpu stack, the RDMA device with rdma;
     the user's own requests and limits kept. Extended resources are quoted strings (what
     server-side apply wants on 1.20). */}}
{{- define "pd-appliance.vllmResources" -}}
{{- $v := (index . 0).Values -}}
{{- $r := index $v (index . 1) -}}
{{- $user := $r.resources | default dict -}}
{{- $requests := deepCopy ($user.requests | default dict) -}}
{{- $limits := deepCopy ($user.limits | default dict) -}}
{{- if eq $v.stack "gpu" -}}
{{- $gpus := include "pd-appliance.tp" . -}}
{{- $_ := set $requests "nvidia.com/gpu" $gpus -}}
{{- $_ := set $limits "nvidia.com/gpu" $gpus -}}
{{- else -}}
{{- /* requests = limits in whole CPUs: a Guaranteed pod gets cores of its own from the
       static CPU manager, and vLLM's OpenMP threads bind to the CPUs it is allowed
       (VLLM_CPU_OMP_THREADS_BIND stays auto). cpuRequest below cpus makes it Burstable:
       pods share cores, so a rollout's surge pod fits a node with no spare core. */ -}}
{{- $_ := set $requests "cpu" (($r.cpuRequest | default "") | toString | default (toString (int $r.cpus))) -}}
{{- $_ := set $limits "cpu" (toString (int $r.cpus)) -}}
{{- end -}}
{{- if eq (include "pd-appliance.protocol" (index . 0)) "rdma" -}}
{{- $_ := set $requests $v.transfer.rdmaResource.name (toString (int $v.transfer.rdmaResource.count)) -}}
{{- $_ := set $limits $v.transfer.rdmaResource.name (toString (int $v.transfer.rdmaResource.count)) -}}
{{- end -}}
{{- toYaml (dict "requests" $requests "limits" $limits) -}}
{{- end -}}

{{- define "pd-appliance.vllmEnv" -}}
{{- $v := (index . 0).Values -}}
{{- $r := index $v (index . 1) -}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: VLLM_HOST_IP
  value: $(POD_IP)
- name: PD_API_KEY_FILE  # the launcher reads it into VLLM_API_KEY
  value: {{ include "pd-appliance.keysDir" (index . 0) }}/api-key
- name: PD_PROTOCOL  # read by the image's preflight too
  value: {{ include "pd-appliance.protocol" (index . 0) }}
- name: PD_RDMA_DEVICE  # the role's devices (the preflight checks them)
  value: {{ include "pd-appliance.rdmaDevices" . | quote }}
- name: PD_GPUDIRECT  # auto: the image's entrypoint picks the mode and tells Mooncake
  value: {{ $v.transfer.gpudirect }}
- name: MC_MIN_RPC_PORT
  value: {{ index $v.transfer.portRange 0 | int | quote }}
- name: MC_MAX_RPC_PORT
  value: {{ index $v.transfer.portRange 1 | int | quote }}
- name: MC_LOG_LEVEL
  value: WARNING
{{- with $v.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT  # vLLM's engine and worker processes, the connector
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
  value: {{ $v.tracing.protocol | quote }}
{{- end }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: VLLM_NO_USAGE_STATS
  value: "1"
- name: DO_NOT_TRACK
  value: "1"
{{- with $r.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A startupProbe on a listener (a port name and the seconds it may take to listen):
     until it passes, liveness is not checked, so a process starved of CPU while it starts
     is not killed and restarted in a loop. */}}
{{- define "pd-appliance.listenerStartup" -}}
startupProbe:
  tcpSocket: {port: {{ index . 0 }}}
  periodSeconds: 2
  timeoutSeconds: 2
  failureThreshold: {{ max 1 (div (add (int (index . 1)) 1) 2) }}
{{- end -}}

{{- define "pd-appliance.httpProbes" -}}
{{- $port := index . 0 -}}
{{- $startup := index . 1 -}}
{{- if $startup }}
startupProbe:  # model loading: up to timeouts.startupS
  httpGet: {path: /health, port: {{ $port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ $startup }}
{{- end }}
readinessProbe:
  httpGet: {path: /health, port: {{ $port }}}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  httpGet: {path: /health, port: {{ $port }}}
  periodSeconds: 10
  timeoutSeconds: 10
  failureThreshold: 6
{{- end -}}

{{/* The model's volume (P, D, and the proxies with proxy.tokenizer), and its mount. */}}
{{- define "pd-appliance.modelVolume" -}}
- name: model
{{- if eq .model.volume.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .model.volume.claimName }}
    readOnly: true
{{- else }}
  hostPath:
    path: {{ .model.volume.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "pd-appliance.modelMount" -}}
- name: model
  mountPath: {{ .model.path }}
  readOnly: true
  {{- with .model.volume.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end -}}

{{- define "pd-appliance.vllmVolumes" -}}
{{- $ctx := index . 0 -}}
{{- $v := $ctx.Values -}}
{{- $r := index $v (index . 1) -}}
{{ include "pd-appliance.keysVolume" $ctx }}
- name: shm  # NCCL and vLLM's workers talk through /dev/shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $r.shmSize }}
{{ include "pd-appliance.modelVolume" $v }}
{{- if eq (index . 1) "prefill" }}
- name: bootstrap-tmp
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The sidecar P's workers register with and the proxy and D query (same pod IP). It
     stops after vLLM: D may still ask it for P's workers while vLLM drains, so its preStop
     waits until vLLM's port closes (within vLLM's own drain time). */}}
{{- define "pd-appliance.bootstrapContainer" -}}
{{- $v := .Values -}}
{{- $drain := include "pd-appliance.shutdownTimeout" (list . "prefill") | int -}}
- name: bootstrap
  image: {{ include "pd-appliance.slimImage" . }}
  imagePullPolicy: {{ $v.images.pullPolicy }}
  args:
    - python
    - -m
    - appliance.bootstrap
    - --host
    - $(POD_IP)
    - --port
    - {{ $v.ports.bootstrap | int | quote }}
    - --ttl
    - {{ $v.bootstrap.ttlS | int | quote }}
    - --token-file
    - {{ include "pd-appliance.keysDir" . }}/bootstrap-token
  env:
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
  ports:
    - {name: bootstrap, containerPort: {{ $v.ports.bootstrap }}, protocol: TCP}
  lifecycle:
    preStop:
      exec:
        command:
          - python
          - -c
          - |
            import os, socket, time
            time.sleep({{ $v.prefill.preStopSleepS | int }})
            end = time.monotonic() + {{ $drain }}
            while time.monotonic() < end:
                try:
                    socket.create_connection((os.environ["POD_IP"], {{ $v.ports.prefill | int }}), 2).close()
                except OSError:
                    break
                time.sleep(1)
  # A start slowed by a busy node (a vLLM loading beside it) is not a dead process: the
  # liveness probe counts only once the sidecar has listened.
  {{- include "pd-appliance.listenerStartup" (list "bootstrap" $v.bootstrap.startupS) | nindent 2 }}
  readinessProbe:
    httpGet: {path: /health, port: bootstrap}
    periodSeconds: 5
    timeoutSeconds: 5
    failureThreshold: 3
  livenessProbe:
    httpGet: {path: /health, port: bootstrap}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 3
  resources:
    {{- toYaml $v.bootstrap.resources | nindent 4 }}
  {{- include "pd-appliance.slimSecurityContext" . | nindent 2 }}
  volumeMounts:
    {{- include "pd-appliance.keysMount" . | nindent 4 }}
    - {name: bootstrap-tmp, mountPath: /tmp}
{{- end -}}

{{/* The engines' KV block size (P's and D's --block-size; the proxy's --kv-block-size). */}}
{{- define "pd-appliance.blockSize" -}}
{{- $v := .Values -}}
{{- toString (int ($v.model.blockSize | default (ternary 32 16 (eq $v.stack "cpu")))) -}}
{{- end -}}

{{/* D's longest prefill chunk while it decodes (vLLM's --long-prefill-token-threshold; 0: no
     cap): D's flag, and the proxy's decode_prefill_chunk, which weighs a local prefill by it. */}}
{{- define "pd-appliance.decodePrefillChunk" -}}
{{- $m := .Values.model -}}
{{- toString (int64 (ternary (ternary 128 512 (eq .Values.stack "cpu")) $m.decodePrefillChunk (kindIs "invalid" $m.decodePrefillChunk))) -}}
{{- end -}}
