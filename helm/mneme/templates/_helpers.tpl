{{/* Names and labels of the mneme chart. */}}

{{- define "mneme.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mneme.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "mneme.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Common labels. */}}
{{- define "mneme.labels" -}}
helm.sh/chart: {{ include "mneme.chart" . }}
app.kubernetes.io/name: {{ include "mneme.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: mneme
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "ingest"). */}}
{{- define "mneme.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mneme.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "mneme.componentLabels" -}}
helm.sh/chart: {{ include "mneme.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: mneme
{{ include "mneme.selectorLabels" . }}
{{- end -}}

{{/* Name of one component's objects: <fullname>-<component>. */}}
{{- define "mneme.componentName" -}}
{{- printf "%s-%s" (include "mneme.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mneme.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mneme.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "mneme.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "mneme.secretName" -}}
{{- default (include "mneme.fullname" .) .Values.existingSecret -}}
{{- end -}}

{{- define "mneme.masterKeySecretName" -}}
{{- default (printf "%s-master-key" (include "mneme.fullname" .)) .Values.masterKey.existingSecret -}}
{{- end -}}

{{- define "mneme.authSecretName" -}}
{{- default (printf "%s-auth" (include "mneme.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "mneme.authEnabled" -}}
{{- if or .Values.auth.apiKeys .Values.auth.existingSecret -}}true{{- end -}}
{{- end -}}

{{/* Dependency URLs: the bundled StatefulSet's when enabled, else the external one. */}}
{{- define "mneme.kafkaUrl" -}}
{{- if .Values.kafka.enabled -}}
{{- printf "kafka://%s-kafka:9092" (include "mneme.fullname" .) -}}
{{- else -}}
{{- required "externalKafka.url is required (or kafka.enabled=true)" .Values.externalKafka.url -}}
{{- end -}}
{{- end -}}

{{- define "mneme.qdrantUrl" -}}
{{- if .Values.qdrant.enabled -}}
{{- printf "http://%s-qdrant:6333" (include "mneme.fullname" .) -}}
{{- else -}}
{{- required "externalQdrant.url is required (or qdrant.enabled=true)" .Values.externalQdrant.url -}}
{{- end -}}
{{- end -}}

{{- define "mneme.opensearchUrl" -}}
{{- if .Values.opensearch.enabled -}}
{{- printf "http://%s-opensearch:9200%s" (include "mneme.fullname" .) (ternary "?per_bank=1" "" (default false .Values.opensearch.perBank)) -}}
{{- else -}}
{{- required "externalOpenSearch.url is required (or opensearch.enabled=true)" .Values.externalOpenSearch.url -}}
{{- end -}}
{{- end -}}

{{- define "mneme.neo4jUrl" -}}
{{- $db := "" -}}
{{- with .Values.externalNeo4j.database }}{{ $db = printf "/%s" . }}{{ end -}}
{{- if .Values.neo4j.enabled -}}
{{- printf "bolt://neo4j:%s@%s-neo4j:7687" (.Values.neo4j.password | urlquery) (include "mneme.fullname" .) -}}
{{- else -}}
{{- $n := .Values.externalNeo4j -}}
{{- if contains "://" $n.host -}}
{{- fail (printf "externalNeo4j.host %q holds a scheme: give host[:port] there and the scheme in externalNeo4j.scheme" $n.host) -}}
{{- end -}}
{{- $scheme := $n.scheme | default "bolt" -}}
{{- if $n.password -}}
{{- printf "%s://%s:%s@%s%s" $scheme ($n.user | urlquery) ($n.password | urlquery) $n.host $db -}}
{{- else -}}
{{- printf "%s://%s%s" $scheme $n.host $db -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Fails the render when search's stores on the shared servers cannot have generation
   .generation (> 1): on Neo4j it is the database <db>-g<n>, so the URL must name
   generation 1's database, and the bundled Neo4j (Community edition) has one database
   only. With existingSecret the URL is not the chart's to check (mneme refuses it). */}}
{{- define "mneme.checkGeneration" -}}
{{- $v := .root.Values -}}
{{- if and (gt (int .generation) 1) (ne $v.searchStores "local") (not $v.existingSecret) -}}
{{- if $v.neo4j.enabled -}}
{{- fail (printf "%s: store generation %d needs a Neo4j database of its own; the bundled Neo4j (neo4j.enabled, Community edition) has one: use an external Neo4j Enterprise with externalNeo4j.database" .what (int .generation)) -}}
{{- else if not $v.externalNeo4j.database -}}
{{- fail (printf "%s: store generation %d is the Neo4j database <db>-g%d: set externalNeo4j.database (generation 1's database)" .what (int .generation) (int .generation)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Fails the render when config or extraEnv (the ConfigMap's values) hold a credential:
   a variable named like one (*_API_KEY, *_PASSWORD, *_SECRET, *_TOKEN, *_HEADERS,
   MNEME_MASTER_KEY) or a URL with credentials (user[:password]@ -- a Qdrant API key goes
   there -- or api_key=/password=/token= in its query). They belong in secretEnv (the
   Secret). File paths such as MNEME_TLS_KEY are not credentials. */}}
{{- define "mneme.checkNoCredentials" -}}
{{- range $where := list "config" "extraEnv" -}}
{{- range $k, $v := index $.Values $where -}}
{{- if or (regexMatch "(^|_)(API_KEY|PASSWORD|SECRET|TOKEN|HEADERS)$|^MNEME_MASTER_KEY$" (upper $k)) (regexMatch "://[^/?#]*@|[?&](api_key|apikey|password|token)=" (toString $v)) -}}
{{- fail (printf "%s.%s looks like a credential and %s is rendered into a ConfigMap: put it in secretEnv (the chart's Secret) or in existingSecret" $where $k $where) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Kafka transport security (externalKafka.tls, externalKafka.sasl): the
   MNEME_KAFKA_SECURITY_PROTOCOL they make, "" when both are off (the server default,
   PLAINTEXT). The bundled broker is plaintext only, so either with kafka.enabled fails. */}}
{{- define "mneme.kafkaTls" -}}
{{- if or .Values.externalKafka.tls.enabled .Values.externalKafka.tls.secretName -}}true{{- end -}}
{{- end -}}

{{- define "mneme.kafkaProtocol" -}}
{{- $tls := include "mneme.kafkaTls" . -}}
{{- $sasl := .Values.externalKafka.sasl.mechanism -}}
{{- if and .Values.kafka.enabled (or $tls $sasl) -}}
{{- fail "externalKafka.tls/sasl: the bundled broker (kafka.enabled) is plaintext only" -}}
{{- end -}}
{{- if and $sasl (not .Values.externalKafka.sasl.username) -}}
{{- fail "externalKafka.sasl.mechanism needs externalKafka.sasl.username" -}}
{{- end -}}
{{- if and $sasl (not .Values.externalKafka.sasl.passwordSecret.name) -}}
{{- fail "externalKafka.sasl.mechanism needs externalKafka.sasl.passwordSecret.name (a Secret holding the password)" -}}
{{- end -}}
{{- if and $tls $sasl -}}SASL_SSL
{{- else if $sasl -}}SASL_PLAINTEXT
{{- else if $tls -}}SSL
{{- end -}}
{{- end -}}

{{/* env entries of every mneme container that come from elsewhere than the ConfigMap and
   the Secret: the Kafka SASL password (a secretKeyRef of a Secret the user manages). */}}
{{- define "mneme.kafkaEnv" -}}
{{- with .Values.externalKafka.sasl }}
{{- if .mechanism }}
- name: MNEME_KAFKA_SASL_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ .passwordSecret.name | quote }}, key: {{ .passwordSecret.key | quote }}}
{{- end }}
{{- end }}
{{- end -}}

{{/* env entries from secretKeyRefs (NAME -> {name, key} of a Secret the user manages), in
   every mneme container; a name the chart sets itself there is refused. */}}
{{- define "mneme.secretRefEnv" -}}
{{- $taken := list "MNEME_KAFKA_SASL_PASSWORD" "MNEME_REPLICA_ID" "MNEME_SEARCH_ADDRESS" "OTEL_SERVICE_NAME" "MNEME_VECTOR_URL" "MNEME_TEXT_URL" "MNEME_GRAPH_URL" }}
{{- range $k, $ref := .Values.secretKeyRefs }}
{{- if has $k $taken }}
{{- fail (printf "secretKeyRefs.%s: the chart sets %s itself (from its values)" $k $k) }}
{{- end }}
- name: {{ $k }}
  valueFrom:
    secretKeyRef: {name: {{ $ref.name | quote }}, key: {{ $ref.key | quote }}}
{{- end }}
{{- end -}}

{{/* The pod-level parts every mneme container shares: env sources and mounts. */}}
{{- define "mneme.envFrom" -}}
- configMapRef:
    name: {{ include "mneme.fullname" . }}
- secretRef:
    name: {{ include "mneme.secretName" . }}
- secretRef:
    name: {{ include "mneme.masterKeySecretName" . }}
{{- end -}}

{{- define "mneme.checksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}

{{/* Volumes every mneme pod has besides its data dir: /tmp, the API-keys file, the gRPC
   certificates and the Kafka certificates. */}}
{{- define "mneme.commonVolumes" -}}
- name: tmp
  emptyDir: {}
{{- if include "mneme.authEnabled" . }}
- name: auth
  secret:
    secretName: {{ include "mneme.authSecretName" . }}
{{- end }}
{{- with .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- with .Values.externalKafka.tls.secretName }}
- name: kafka-tls
  secret:
    secretName: {{ . }}
{{- end }}
{{- end -}}

{{- define "mneme.commonMounts" -}}
- name: data
  mountPath: /var/lib/mneme
- name: tmp
  mountPath: /tmp
{{- if include "mneme.authEnabled" . }}
- name: auth
  mountPath: /etc/mneme/auth
  readOnly: true
{{- end }}
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: /etc/mneme/tls
  readOnly: true
{{- end }}
{{- if .Values.externalKafka.tls.secretName }}
- name: kafka-tls
  mountPath: /etc/mneme/kafka-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* How a probe reaches grpc.health.v1: Kubernetes' native gRPC probe (plaintext only),
   or with TLS the image's health check script (the pod's MNEME_TLS_* / MNEME_CLIENT_TLS_*
   settings, see deploy/healthcheck.py). (dict "root" $ "service" NAME): the health
   service asked: "" (readiness: dependencies up, the replica's own copies caught up) or
   "liveness" (the process answers; startup and liveness probes, so a long catch-up or a
   broker outage takes a pod out of the Services without restarting it). */}}
{{- define "mneme.probeAction" -}}
{{- if .root.Values.tls.secretName -}}
exec: {command: {{ toJson (concat (list "python" "/usr/local/lib/mneme/healthcheck.py") (compact (list .service))) }}}
{{- else if .service -}}
grpc: {port: {{ .root.Values.grpcPort }}, service: {{ .service }}}
{{- else -}}
grpc: {port: {{ .root.Values.grpcPort }}}
{{- end -}}
{{- end -}}

{{/* Pod-level settings shared by Deployments and Jobs. */}}
{{- define "mneme.podCommon" -}}
serviceAccountName: {{ include "mneme.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automountToken }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* affinity of a pod: (dict "root" $ "component" NAME); component "" (Jobs): the values'
   affinity only. A service's pods also get pod anti-affinity against the pods of the same
   service (podAntiAffinity.mode), unless the values' affinity sets its own. */}}
{{- define "mneme.affinity" -}}
{{- $aff := deepCopy (.root.Values.affinity | default dict) }}
{{- $anti := .root.Values.podAntiAffinity }}
{{- if and .component (ne $anti.mode "none") (not (hasKey $aff "podAntiAffinity")) }}
{{- $term := dict "topologyKey" $anti.topologyKey "labelSelector" (dict "matchLabels" (include "mneme.selectorLabels" . | fromYaml)) }}
{{- if eq $anti.mode "required" }}
{{- $_ := set $aff "podAntiAffinity" (dict "requiredDuringSchedulingIgnoredDuringExecution" (list $term)) }}
{{- else }}
{{- $_ := set $aff "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" (int $anti.weight) "podAffinityTerm" $term))) }}
{{- end }}
{{- end }}
{{- with $aff -}}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The data volume (MNEME_DATA_DIR) of one pod, from a service's dataDir values: an
   emptyDir of sizeLimit, or a generic ephemeral volume (a PVC of its own per pod, deleted
   with the pod). Never a claim shared by pods: each replica's data dir is its own cache. */}}
{{- define "mneme.dataVolume" -}}
- name: data
  {{- if eq .type "ephemeral" }}
  ephemeral:
    volumeClaimTemplate:
      spec:
        accessModes: [ReadWriteOnce]
        {{- with .storageClass }}
        storageClassName: {{ . | quote }}
        {{- end }}
        resources:
          requests:
            storage: {{ .sizeLimit | quote }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .sizeLimit | quote }}
  {{- end }}
{{- end -}}
