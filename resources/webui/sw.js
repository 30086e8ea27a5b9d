// Mixdesk's service worker.
//
// The page shell (the chat page, its manifest and icon) is kept in a cache so the
// page still opens when the server is down or restarting; it then says it cannot
// reach the server instead of the browser's error page. Everything else, above all
// the API (/v1/..., /lora-adapters, ...), is never intercepted: it always goes to
// the network, and no reply, prompt or key ever lands in a cache.
'use strict';

const CACHE = 'mixdesk-shell-v1';
const SHELL = ['/', '/manifest.webmanifest', '/icon-256.png'];

self.addEventListener('install', (event) => {
  event.waitUntil(
    caches.open(CACHE)
      .then((cache) => cache.addAll(SHELL))
      .then(() => self.skipWaiting())
  );
});

self.addEventListener('activate', (event) => {
  // drop the caches of older versions of this worker
  event.waitUntil(
    caches.keys()
      .then((keys) => Promise.all(keys.filter((k) => k !== CACHE).map((k) => caches.delete(k))))
      .then(() => self.clients.claim())
  );
});

self.addEventListener('fetch', (event) => {
  const request = event.request;
  if (request.method !== 'GET') return;
  const url = new URL(request.url);
  if (url.origin !== self.location.origin || !SHELL.includes(url.pathname)) return;
  // Network first: a new version of the page shows up at once; the cached copy is
  // only for when the server cannot be reached. Keyed by path, so '/?x' is '/'.
  event.respondWith(
    fetch(request)
      .then((response) => {
        if (response.ok) {
          const copy = response.clone();
          event.waitUntil(caches.open(CACHE).then((cache) => cache.put(url.pathname, copy)));
        }
        return response;
      })
      .catch(() => caches.match(url.pathname).then((hit) => hit || Response.error()))
  );
});
