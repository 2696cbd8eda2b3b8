{{/*
How the gateway container gets Redis: no credential travels in its environment. The Secret key
holding the whole URL, or the password, is mounted as a file under batchgate.redis.mountDir and the
server reads it (redis_url_file / redis_password_file, gateway/config.py); the env holds only the
file's path, or a URL without a password beside the password file's path.
*/}}
{{- define "batchgate.redis.mountDir" -}}/etc/batchgate/redis{{- end }}

{{/*
The one Secret key the gateway reads, as JSON {secret, key, path} (path: the file under mountDir,
"url" or "password"); empty when it needs none (redis.mode=none, or parts without a password).
*/}}
{{- define "batchgate.redis.credential" -}}
{{- $r := .Values.redis }}
{{- if and (eq $r.mode "external") $r.existingSecretUrlKey }}
{{- dict "secret" $r.existingSecret "key" $r.existingSecretUrlKey "path" "url" | toJson }}
{{- else if include "batchgate.secret.redisUrl" . }}
{{- dict "secret" (include "batchgate.secretName" .) "key" "redis-url" "path" "url" | toJson }}
{{- else if and (ne $r.mode "none") (include "batchgate.redis.passwordSecret" .) }}
{{- dict "secret" (include "batchgate.redis.passwordSecret" .) "key" (include "batchgate.redis.passwordKey" .) "path" "password" | toJson }}
{{- end }}
{{- end }}

{{/* The gateway's Redis env: BATCHGATE_REDIS_URL_FILE, or BATCHGATE_REDIS_URL (no password) and BATCHGATE_REDIS_PASSWORD_FILE. */}}
{{- define "batchgate.redisEnv" -}}
{{- $r := .Values.redis }}
{{- $cred := dict }}
{{- with include "batchgate.redis.credential" . }}{{ $cred = fromJson . }}{{ end }}
{{- $file := "" }}
{{- if $cred }}{{ $file = printf "%s/%s" (include "batchgate.redis.mountDir" .) $cred.path }}{{ end }}
{{- if ne $r.mode "none" }}
{{- if eq (get $cred "path") "url" }}
{{- /* The whole URL is secret (the CA query, if any, is in it already: secret.yaml, or yours). */}}
- name: BATCHGATE_REDIS_URL_FILE
  value: {{ $file | quote }}
{{- else }}
{{- if eq $r.mode "internal" }}
{{- include "batchgate.redisComposedUrl" (dict "ctx" . "host" (include "batchgate.redis.host" .) "port" 6379 "db" 0 "tls" false "username" "") }}
{{- else }}
{{- include "batchgate.redisComposedUrl" (dict "ctx" . "host" $r.host "port" $r.port "db" $r.db "tls" $r.tls "username" $r.username) }}
{{- end }}
{{- if $file }}
{{- /* The server puts it, percent-encoded, into the URL's authority beside the username. */}}
- name: BATCHGATE_REDIS_PASSWORD_FILE
  value: {{ $file | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* redis[s]://[user@]host:port/db[?ssl_ca_certs=…]: the URL from parts, never with a password. */}}
{{- define "batchgate.redisComposedUrl" -}}
{{- $auth := ternary (printf "%s@" .username) "" (ne .username "") }}
{{- $url := printf "%s://%s%s:%s/%s" (ternary "rediss" "redis" .tls) $auth .host (include "batchgate.envValue" .port) (include "batchgate.envValue" .db) }}
- name: BATCHGATE_REDIS_URL
  value: {{ include "batchgate.redis.withCa" (dict "ctx" .ctx "url" $url) | quote }}
{{- end }}

{{/* The gateway's mount of that Secret key: a directory (no subPath), so a rotated Secret reaches the file. */}}
{{- define "batchgate.redis.volumeMount" -}}
{{- if include "batchgate.redis.credential" . }}
- name: redis-credentials
  mountPath: {{ include "batchgate.redis.mountDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "batchgate.redis.volume" -}}
{{- with include "batchgate.redis.credential" . }}
{{- $cred := fromJson . }}
- name: redis-credentials
  secret:
    secretName: {{ $cred.secret }}
    # Only the one key, as the file the env names; 0440 so only the pod's group reads it.
    defaultMode: 0440
    items:
      - key: {{ $cred.key }}
        path: {{ $cred.path }}
{{- end }}
{{- end }}
